"""One module per feature. Each owns its algorithm, its flags and its patches; the plugin
loader imports every module here, so adding a feature means adding a module."""
