"""Where an artifact came from: the code that made it (`stages.provenance.code`)."""
