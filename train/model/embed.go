package model

// embedForward copies row tok[t] of table [V, h] into row t of x.
func embedForward(x, table []float32, tok []int32, h int) {
	for t, id := range tok {
		copy(x[t*h:(t+1)*h], table[int(id)*h:(int(id)+1)*h])
	}
}

// embedBackward adds row t of dx into row tok[t] of dTable.
func embedBackward(dTable, dx []float32, tok []int32, h int) {
	for t, id := range tok {
		dst, src := dTable[int(id)*h:(int(id)+1)*h], dx[t*h:(t+1)*h]
		for j := range dst {
			dst[j] += src[j]
		}
	}
}
