"""weightsync vLLM plugin (engines registered per channel) and the replica agent."""
