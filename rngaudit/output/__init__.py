"""Every report format: findings, JSON, SARIF, GitHub annotations, and the rich text renderers and progress bar
(the only modules that import rich)."""
