"""The step: towers (one replica each, with its stager and optimizer) and the engine that runs a step over them."""
