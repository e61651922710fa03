"""DISCO (dynamic speculation length): collect draft features, train the classifier, tune
tau and SL_max, compare with baselines. The controller itself is `control.disco`."""
