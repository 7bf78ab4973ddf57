"""The runtime: the engine, the decode graphs, the generation worker and its prompt cache."""
