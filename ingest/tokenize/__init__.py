"""Tokenizers: loading one by name or file (``tokenizer``), vocabulary files, and the exact faster
BPE backends."""
