"""The post-mortem of a job (`trainwarden report`): one self-contained HTML page, drawn from what the job left in
its state directory: its history (step times, rounds, failures, goodput), incidents and checkpoints.

``data`` gathers and thins it (no plotly); ``page`` draws it with plotly, imported only when a page is drawn, so
the agent never loads plotly unless a page is drawn. It imports ``common``, ``incidents`` and ``shared``;
the CLI imports it.
"""

from trainwarden.agent.report.data import ReportData, ReportError, gather

__all__ = ["ReportData", "ReportError", "build_report", "gather", "render", "write_report"]

_PAGE = ("build_report", "render", "write_report")


def __getattr__(name: str):
    if name in _PAGE:  # page.py draws with plotly: loaded when first used
        from trainwarden.agent.report import page

        return getattr(page, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
