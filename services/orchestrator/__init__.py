"""The orchestrator: chats, messages, runs, interrupts, the agent loop and run events."""
