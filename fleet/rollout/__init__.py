"""Rollouts: the pure planner and state machine, the orchestrator that runs them."""
