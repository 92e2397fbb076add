"""SWE task data: the instance schema, dataset loaders and registries, prompt processors and the
model-output patch formats."""
