"""Deployment: `fleetbatch gateway up` (a fleet of local engines beside the gateway), the fleet's plans (fleet_up) and the supervisor that restarts engines."""
