"""The context-aware draft router (Huang et al.), inference side: arms (the methods it
chooses from), the policy (an MLP over the prompt's final hidden state), the artifact file,
and `router`, the engine that routes each request to one arm's engine. Collecting data and
training live in `adaspec.lab.router`."""
