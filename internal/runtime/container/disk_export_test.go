package container

// WarmReady is how many pre-started agents b holds ready.
func WarmReady(b *Backend) int { return len(b.warm) }
