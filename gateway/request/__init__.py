"""From a parsed body to a plan: prompt token estimates (tokens), the pipeline that reads,
checks, counts and plans a request before admission (plan), and the planned request the
relay carries out (exchange)."""
