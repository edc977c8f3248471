"""Small backends with a local and an Azure implementation each: Blob, file share, image
builder, cluster. The flow's tasks call these; the local ones run this machine's stand-ins on
the same code paths wherever they can be the same.
"""
