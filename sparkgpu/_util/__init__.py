"""The package's private shared helpers (files, processes, reports, URLs, ...): every module may use their public names."""
