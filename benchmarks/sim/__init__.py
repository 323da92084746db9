"""The discrete-event simulator and the agentic-RL workload the ACT benchmark runs schedulers on."""
