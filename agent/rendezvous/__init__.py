"""TODO"""
from trainwarden.agent.rendezvous.backend import handler_factory
