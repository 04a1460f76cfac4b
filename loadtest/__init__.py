"""Load tests: locust users for pd-router (`locustfile.py`) and headless scenarios (`python -m loadtest`).

- `workload`: prompts, answer lengths, request bodies and the judging of answers (pure);
- `locustfile`: the locust users (TTFT / ITL / end-to-end as locust metrics, fixed-rate mode);
- `stack`: the simulated fleet and pd-router as real processes; `load`: locust as a process;
- `scenarios`: steady, convert, weights, kill; `summary`: the verdict.
"""
