"""SDK v3's ``sagemaker.core``: the parts a training notebook imports from it."""
