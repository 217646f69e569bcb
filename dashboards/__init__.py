"""The dashboards and the tools around them (not installed with trainwarden; run from the repository root).

``grafana/build.py`` generates the Grafana dashboards, ``prometheus/alerts.yml`` holds the alert and recording
rules, ``queries`` runs the dashboards' queries against Prometheus as Grafana would and ``render`` draws a
picture of a dashboard from them (the pictures in docs/OPERATIONS.md), showing values as ``units`` says.
"""
