"""The fleet: each fellow's control link, the links between fellows (direct links, the measured link matrix, the
relay), model files and updates served to fellows, and the one-command install of a new PC."""
