"""SLO autoscaling: each pool sized by its own latency target (prefill by TTFT, decode by ITL).

``planner``: the pure decision rule (signals in, desired replica count out). ``policy``: the
Ray Serve custom autoscaling policy that feeds it replica-reported metrics. ``window``: the
replica-side sliding window those metrics come from. ``simulator``: a deterministic model of
both pools that replays arrival traces through the planner, to tune and test it.
"""
