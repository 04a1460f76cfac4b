"""Multi-step fleet operations: role conversion, weight updates, fan-out, the rebalancer loop."""
