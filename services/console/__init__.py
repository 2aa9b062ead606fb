"""The console: the fleet, the tenants and the log in a browser, served by the admin API at ``/console``."""
