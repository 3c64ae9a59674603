"""Stage 5, pages: incidents and the alerter that de-duplicates, escalates and resolves them
(``incidents``, ``alerter``), the message every channel sees (``message``), one class per channel
(webhook, Slack, PagerDuty, Alertmanager, ``channels``), and each channel's own queue and sender
threads (``queue``, ``delivery``), so that each fails and waits on its own.
"""
