"""The application: the `mlp-offload` command (cli), the main job (train) with its models and shipped
corpus (models, data), and the tables they print (tables). Imports any layer below it."""
