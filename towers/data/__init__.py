"""Input, first stage of the data flow: datasets, shuffled global batches, staging onto devices."""
