"""Evaluation: requests cut into tokenized sequences (``requests``) and planned into global batches
(``batches``)."""
