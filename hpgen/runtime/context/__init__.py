"""Context parallelism (the ``cp`` axis): attention, the key/value cache and the merge of partial attention."""
