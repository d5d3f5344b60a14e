"""Prompts shared by the tests and the GPU script: for the engine invariance tests, four with a
common system prompt (prefix cache hits), the rest short and distinct; for comparisons with
transformers, short prompts of several kinds (prose, code, lists, translation, a question)."""

SYSTEM = (
    "You are a careful assistant. Answer briefly and precisely, and never invent facts. "
    "When asked about numbers, show the arithmetic step by step before the answer. "
)
PROMPTS = [
    SYSTEM + q
    for q in (
        "What is 12 times 7?",
        "Name the largest planet.",
        "Why is the sky blue?",
        "Write a short greeting.",
    )
] + [
    "The history of the printing press begins",
    "import numpy as np\n\ndef softmax(x):",
    "Roses are red,",
    "In 1969, the first humans",
    "A list of fruits: apple, banana,",
    "The mitochondria is",
    "Dear Sir or Madam,",
    "SELECT name FROM users WHERE",
    "La vie est",
    "To be or not to be,",
    "Step 1: preheat the oven.",
    "The answer to life, the universe and everything is",
]

REFERENCE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers:",
    "Translate to French: I like apples.",
    "The quick brown fox",
    "1, 2, 3, 4, 5,",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "Émile a écrit un poème sur l'hiver 🌨️ :",
]
