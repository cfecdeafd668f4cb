"""Training through the swarm: autograd through remote blocks (:mod:`.backward`) and trainable
prompts on the client (:mod:`.prompts`)."""
