"""OpenAI-compatible HTTP gateway over a swarm and the live swarm dashboard (``shoal api``,
``shoal dashboard``): :mod:`~shoal.gateway.engine` generates, :mod:`~shoal.gateway.app` serves HTTP,
:mod:`~shoal.gateway.swarm` watches swarm tables, :mod:`~shoal.gateway.serve` runs it all. Their
flags are the CLI's (:mod:`shoal.cli.gateway`).

Import-light on purpose: nothing heavy loads until a command runs."""
