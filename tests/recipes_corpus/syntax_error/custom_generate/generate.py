def generate(model):
    return (1
