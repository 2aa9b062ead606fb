"""Keys, limits, prices and budgets: the access service's rules and command handling."""
