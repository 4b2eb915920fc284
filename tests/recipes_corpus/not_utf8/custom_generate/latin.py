# café
X = 1
