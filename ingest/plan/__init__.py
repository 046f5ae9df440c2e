"""The plan: the corpus cut into units (``build``), and the deal of units to streams each epoch
(``deal``)."""
