
	fuzz-nodefuzz