"""TODO"""
from trainwarden.agent.cli.main import main
