"""Finding call sites that receive identical randomness (`rngaudit collisions`): the sites of a spec or a JSON
file, grouped by key and classified, with latent pairs and verified fixes."""
