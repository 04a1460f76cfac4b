"""What the harnesses share (tests, bench, loadtest, server_patches): stdlib only, nothing of the router."""
