"""Loading models through their architecture plugin and wrapping them for the runner; MoE experts."""
