"""The language models: the family-neutral model, each family's equations, layers, sampling."""
