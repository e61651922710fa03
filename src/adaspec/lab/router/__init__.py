"""The router's offline work: collect arm rewards and prompt states, train and evaluate the
policy, report. The router engine itself is `route.router`."""
