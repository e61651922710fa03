"""OSD in the lab: replay a stream of requests through online distillation and report it."""
