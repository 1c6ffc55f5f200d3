"""Framework adapters: each imports only its own framework."""
