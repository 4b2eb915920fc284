"""transformers' quick start for text generation ("Generation with LLMs" / "Text generation" guides),
with only two changes: the import line, and the checkpoint path (a local folder the test builds).
tests/test_swap.py runs it as it is and with the transformers import, and compares the output."""

import torch

from genkit import AutoModelForCausalLM, AutoTokenizer  # was: from transformers import ...

checkpoint = "./tiny-model"  # was: "mistralai/Mistral-7B-v0.1"

model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map="auto", dtype="auto")
tokenizer = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")

# generate from one prompt
model_inputs = tokenizer(["A list of colors: red, blue"], return_tensors="pt").to(model.device)
generated_ids = model.generate(**model_inputs)
print(tokenizer.batch_decode(generated_ids, skip_special_tokens=True)[0])

# a padded batch
tokenizer.pad_token = tokenizer.eos_token  # most LLMs don't have a pad token by default
model_inputs = tokenizer(
    ["A list of colors: red, blue", "Portugal is"], return_tensors="pt", padding=True
).to(model.device)
generated_ids = model.generate(**model_inputs, max_new_tokens=10)
print(tokenizer.batch_decode(generated_ids, skip_special_tokens=True))

# encode / decode
input_ids = tokenizer.encode("the quick brown fox", return_tensors="pt").to(model.device)
output = model.generate(input_ids, max_new_tokens=8, do_sample=False)
print(tokenizer.decode(output[0], skip_special_tokens=True))
print(output.shape, input_ids.dtype)

# a chat
messages = [
    {"role": "system", "content": "You are a friendly chatbot."},
    {"role": "user", "content": "hello world, how many colors are there?"},
]
model_inputs = tokenizer.apply_chat_template(
    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
).to(model.device)
input_length = model_inputs["input_ids"].shape[1]
generated_ids = model.generate(**model_inputs, max_new_tokens=12)
print(tokenizer.decode(generated_ids[0][input_length:], skip_special_tokens=True))
print(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

# padding encodings made earlier
features = [tokenizer("the lazy dog"), tokenizer("hello")]
batch = tokenizer.pad(features, return_tensors="pt")
print(batch["input_ids"].tolist(), batch["attention_mask"].tolist())

# seeded sampling
torch.manual_seed(0)
sampled = model.generate(**tokenizer(["numbers"], return_tensors="pt").to(model.device), do_sample=True,
                         max_new_tokens=6, top_k=50)
print(sampled.shape)
