"""Stage 5, pages: incidents and the alerter that de-duplicates, escalates and resolves them
(``alerter``), and one class per channel (webhook, Slack, PagerDuty, Alertmanager) that fails on its
own (``channels``).
"""
