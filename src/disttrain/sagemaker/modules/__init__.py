"""SDK v2's ``sagemaker.modules`` (2.23x): the same ModelTrainer classes as v3's ``sagemaker.train``."""
