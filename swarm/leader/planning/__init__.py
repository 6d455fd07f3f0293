"""Know before you load: placement of stages over fellows (by memory, and by measured links), the planner's speed
predictions, early fit checks, failover's choices, auto-load and the draft model's choice, as pure functions."""
