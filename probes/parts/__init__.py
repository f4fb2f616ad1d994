"""The probes' shared parts, public to probes and experiments: the pair-and-margin loop and item
fields (`common`), head rankings and curves (`heads`), per-item readouts and paired intervals
(`readouts`). Job modules are never imported as libraries; what two jobs share lives here."""
