"""miles.sync inside other frameworks: plugins that let their engines receive Miles weight updates."""
