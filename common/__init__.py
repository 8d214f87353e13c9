"""Small helpers shared by every package: errors and config validation. Imports nothing heavy."""
