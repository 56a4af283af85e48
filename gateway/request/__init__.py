"""From a parsed body to a plan: prompt token estimates (tokens) and the pipeline that
reads, checks, counts and plans a request before admission (plan)."""
