"""Multi-step operations on workers (role conversion, weight updates): named steps with deadlines."""
